"""cyclebox host controller.

Only code in this package talks to Docker, git or a real credential. Code that
runs inside role containers lives in :mod:`sandbox` and never imports this.
"""

__version__ = "0.1.0"
