"""The session layer: who holds a connection to the server and the registrations on it.

* :mod:`.connection`: the transport plus the profile probed per connection (encode,
  submit, decode);
* :mod:`.control`: the control plane (lookups, clears, the server's status);
* :mod:`.registration` and :mod:`.binding`: a registered KV cache, its two transfer
  modes, and the state machine of its binding to the server; :mod:`.request`: the
  per-request bookkeeping;
* :mod:`.deadlines`: the time a call has left;
* :mod:`.engine_driven` and :mod:`.blocks`: the server's pool, its slots and the copies;
  block-id and range checks;
* :mod:`.registry`: a client's registrations and their heartbeat;
* :mod:`.instance_ids`: the instance-id API (``Client.instance_ids``).

:class:`lmcache_mp.Client` builds on these; callers use the names :mod:`lmcache_mp`
exports. This package imports nothing on its own (its modules load on first use).
"""
