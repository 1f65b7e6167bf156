"""Drop-in surfaces for code written against other libraries' APIs (bitsandbytes), kept
apart from tightfit's own API: the names and signatures are theirs, the kernels tightfit's."""
