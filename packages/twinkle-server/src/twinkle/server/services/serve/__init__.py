"""``twinkle server --ray``: the model as a Ray Serve deployment of N replicas, tenants pinned to replicas.

``engine`` is the front end's side (one scheduler per replica, run placement),
``replica`` the deployment (a ``ModelPool`` per replica), ``router`` Serve's
request router that sends each call to the replica its run was placed on, and
``live`` the replica list that router keeps for the engine.
"""
