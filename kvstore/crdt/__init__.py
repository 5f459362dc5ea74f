"""Location CRDT and peer replication.

``register.py`` (the per-slot register and its record layout), ``merge.py``
(the vectorized join applied to the slot table), ``delta.py`` (wire messages,
validated on decode), ``log.py`` (an owner's delta log for anti-entropy),
``transport.py`` (CurveZMQ sockets and the authenticator), ``serverkeys.py`` (each
server's CurveZMQ keypair, and the rule that a machine serves a server only with
its private key), ``agent.py`` (the sync agent process). Uses ``kvstore.shm`` and
``kvstore.config``; the supervisor (``kvstore.service``) applies merges, nothing here
writes the slot table except through ``merge.apply``.
"""
