from kuberl.cli import main

raise SystemExit(main())
