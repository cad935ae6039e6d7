"""`dtrain export`: the command, the registry of the formats it writes (formats.py), each format's
writing and read-back check in its own module, and the checkpoint's model they all start from."""
