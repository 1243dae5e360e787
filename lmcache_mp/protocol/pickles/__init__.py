"""LMCache's wrapper pickles, written by hand: :mod:`.emitter` (:func:`~.emitter.emit`
and one helper per wrapper class), over its parts, one job each:

* :mod:`.opcodes`: the protocol-4 opcode bytes and the writers that turn a validated
  value, and a whole wrapper, into the opcodes ``pickle.dumps`` writes for it;
* :mod:`.fields`: the field types of a template, each a validator that turns a caller's
  value into a plain builtin (and the torch dtype names we write);
* :mod:`.templates`: the annotated wrapper-class templates (``pickle_templates/*.json``)
  and their loader.

Callers use :mod:`.emitter` (also importable as :mod:`lmcache_mp.pickle_emitter`).
Nothing here imports the rest of :mod:`lmcache_mp.protocol`, lmcache or torch.
"""
