from dynamo.cli.v1.mistralrs import main

raise SystemExit(main())
