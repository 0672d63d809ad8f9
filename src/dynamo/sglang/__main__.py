from dynamo.cli.v1.sglang import main

raise SystemExit(main())
