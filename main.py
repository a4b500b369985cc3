"""kvscope: `python main.py` opens the desktop app; `python main.py chat --document FILE --ask "..."` is the CLI."""
import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
