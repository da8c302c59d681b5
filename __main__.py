"""``python -m shardsmith`` runs the command line."""

from shardsmith.cli.main import main

if __name__ == "__main__":
    main()
