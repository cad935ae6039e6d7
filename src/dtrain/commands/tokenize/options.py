"""`dtrain tokenize`'s command line (the parser is built for every command: nothing here imports
more than argparse)."""

from __future__ import annotations

import argparse


def add_options(p: argparse.ArgumentParser) -> None:
    """`dtrain tokenize`'s options, on its parser."""
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="UTF-8 .txt files, .jsonl files, parquet files, folders of them, or datasets "
        "save_to_disk folders (of a DatasetDict: its train split, and for --val its "
        "validation or test split); a document is a file, a JSON line or a row",
    )
    p.add_argument("--corpus", choices=("python_docs",), help="the built-in corpus instead")
    p.add_argument("--out", metavar="DIR", required=True, help="where the shards go")
    tokenizer = p.add_mutually_exclusive_group(required=True)
    tokenizer.add_argument(
        "--vocab-size", type=int, metavar="N", help="train a byte-level BPE of N tokens"
    )
    tokenizer.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="use this tokenizer.json, or a model's folder with one (its own tokenizer)",
    )
    held_out = p.add_mutually_exclusive_group()
    held_out.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="hold out the last F of the token stream for validation (default 0.1)",
    )
    held_out.add_argument(
        "--val", nargs="+", metavar="INPUT", help="validation inputs instead of a held-out part"
    )
    p.add_argument(
        "--column",
        help="the text field or column of .jsonl, parquet, datasets (default text; with --chat, "
        "the messages: default messages)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help='conversations ({"messages": [{"role", "content"}, ...]} rows) rendered with the '
        "--tokenizer MODEL_DIR's chat template; loss masks count the assistant's replies",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="pack whole documents into windows of --seq-len, attention never crossing from "
        "one to another (--chat always packs)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="with --chat or --pack: the window documents are packed in, whole (default 256; "
        "train with data.tokens.seq_len a multiple of it)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="K",
        help="encoding threads, at most the cores this process may use (default: all of them)",
    )
    p.add_argument(
        "--render-timeout",
        type=float,
        metavar="S",
        help="with --chat: the seconds rendering one conversation with the chat template may "
        "take (default 10)",
    )
    p.add_argument(
        "--eot",
        metavar="TOKEN",
        help="the end-of-text token (default <|endoftext|>; for --tokenizer, a folder's "
        "eos_token, else the first it has of <|endoftext|>, <|end_of_text|>, </s>, <eos>)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the shards already in --out")
