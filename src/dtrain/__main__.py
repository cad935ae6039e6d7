from dtrain.cli import entry

entry()
