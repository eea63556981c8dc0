"""Float64 reference implementations, written from the papers' algorithm descriptions.

They share nothing with ``frugal/``: numpy only, the left-projection form of each paper (a tall
matrix is handled by transposing the problem), explicit loops where the papers use them. Tests
compare the library's pure functions against them.
"""
