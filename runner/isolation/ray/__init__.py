"""A Ray cluster backend for the Sandbox seam: the same hardened Docker run, on a node.

:mod:`.backend` is the head side (the :class:`Sandbox` the cycle receives), :mod:`.node`
the code a Ray task runs on a node, :mod:`.relay` the gateway relay (credentials stay on
the head) and :mod:`.archive` the content-addressed input and bounded output archives.
"""
