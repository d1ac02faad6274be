"""Work in other processes: a function run in a fresh one started with other environment variables
(`in_environment`: `--set env.NAME=VALUE`), and independent jobs fanned out over local processes or a Ray cluster
(`fanout`: `check CORPUS`, `stress`)."""
