from dynamo.cli.v1.mocker import main

raise SystemExit(main())
