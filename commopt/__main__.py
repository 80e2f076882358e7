from commopt.cli import main

raise SystemExit(main())
