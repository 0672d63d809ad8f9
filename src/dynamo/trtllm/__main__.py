from dynamo.cli.v1.trtllm import main

raise SystemExit(main())
