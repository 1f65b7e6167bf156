"""Drop-in surfaces for code written against other libraries' APIs, kept apart from
tightfit's own API: the names and signatures are theirs, the kernels tightfit's.

- :mod:`tightfit.compat.bitsandbytes`: ``bitsandbytes``, ``bitsandbytes.functional`` and
  ``bitsandbytes.nn``.
"""
