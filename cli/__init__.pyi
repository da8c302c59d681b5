# The face of shardsmith.cli: the console script enters through shardsmith.cli.main:main; no
# names are imported from cli by other packages.
