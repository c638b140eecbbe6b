"""`python -m specdec.kit build|evaluate ...`"""

import sys

from .cli import main

sys.exit(main())
