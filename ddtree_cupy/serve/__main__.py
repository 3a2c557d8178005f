"""``python -m ddtree_cupy.serve``."""
import sys

from .main import main

sys.exit(main())
