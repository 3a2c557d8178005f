"""``python -m ddtree_cupy`` is ``python -m ddtree_cupy.run``."""
import sys

from .run import main

sys.exit(main())
