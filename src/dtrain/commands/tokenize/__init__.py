"""`dtrain tokenize`: text, documents or conversations into the token files (and loss masks)
that `data.name: tokens` reads, with its command line, inputs, packing and writing."""
