from dynamo.cli.v1.llama_cpp import main

raise SystemExit(main())
