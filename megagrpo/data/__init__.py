"""Problem data: IgakuQA and ms-swift JSONL loaders, prompt rendering."""

from megagrpo.data.loader import ProblemList, iter_jsonl_files, load_problems, read_jsonl
from megagrpo.data.prompts import render_messages

__all__ = ["ProblemList", "iter_jsonl_files", "load_problems", "read_jsonl", "render_messages"]
