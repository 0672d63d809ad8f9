from dynamo.cli.v1.router import main

raise SystemExit(main())
