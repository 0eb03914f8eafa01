"""The `luwu` command line: one module per subcommand, dispatched by main.py."""
