from dynamo.cli.v1.vllm import main

raise SystemExit(main())
