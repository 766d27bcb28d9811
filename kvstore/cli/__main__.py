"""``python -m kvstore.cli``: the same command as ``python -m kvstore``."""

from kvstore.cli import main

if __name__ == "__main__":
    main()
