"""``python3 -m commopt.gpu_check``: see :mod:`commopt.gpu_check`."""

from commopt.gpu_check import main

raise SystemExit(main())
