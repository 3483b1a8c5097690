"""Constrained output: a request's GBNF grammar or JSON Schema as an llguidance matcher whose work
per token is bounded (:mod:`.matcher`), and the bounded GBNF reader that turns llama.cpp's grammar
format into llguidance's (:mod:`.gbnf`)."""
