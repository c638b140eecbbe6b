"""The demo model kit: a tokenizer, a Llama target, a distilled draft, Medusa heads and an EAGLE head,
trained from scratch on the Python standard library's source and written in Hugging Face layouts.

No weights can be downloaded, so the kit trains its own family; the serving path then loads it
exactly like a real checkpoint. `main(argv)` is the command line (`python -m specdec.tools.kit`).
"""

from specdec.tools.kit.cli import main

__all__ = ["main"]
