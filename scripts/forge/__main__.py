"""`python -m forge`: an interrupt while the tool is still loading its verbs (Ctrl-C in its first
moments) ends it with one line and exit code 130, as an interrupt while a verb runs does."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:
    print("forge: interrupted while starting; nothing was done", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
