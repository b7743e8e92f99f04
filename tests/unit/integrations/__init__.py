"""Pinning tests: each private or undocumented vLLM / Ray API rayattn calls or reads
(rayattn/integrations/ and the few places that rely on one directly) is checked against the
installed library, failing with the library's version, what changed and who relies on it.
Library imports sit inside the tests: a library that moved something fails that pin, not the
collection of every test here."""
