"""The annotated pickle opcode templates (JSON), one per LMCache wrapper class.

This folder sits at the top of the repository, as the project's design names it, and
is installed as the package ``lmcache_mp.pickle_templates`` (see ``pyproject.toml``)
so that :mod:`lmcache_mp.protocol.pickles.templates` finds them with importlib.resources.
"""
