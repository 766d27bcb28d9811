"""``python -m kvstore``: the ``kvstore`` command."""

from kvstore.cli import main

if __name__ == "__main__":
    main()
