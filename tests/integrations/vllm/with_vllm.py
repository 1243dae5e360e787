"""Run a script under an LMCache oracle venv with vLLM importable from .venv-vllm.

``<oracle python> with_vllm.py VLLM_SITE_PACKAGES SCRIPT ARGS...``: the oracle venv's
own packages (lmcache and its pins) come first; vLLM and what only it needs come from
``.venv-vllm`` after them, so LMCache's connector runs against the same vLLM tree
as ours.
"""

import runpy
import sys

site = sys.argv[1]
sys.path.append(site)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
