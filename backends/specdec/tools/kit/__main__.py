"""`python -m specdec.tools.kit build|evaluate ...`"""

import sys

from specdec.tools.kit.cli import main

sys.exit(main())
