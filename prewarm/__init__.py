"""Model delivery: put a model's weights into the cache before a serving Pod needs them.

`python -m prewarm hub` downloads one revision of a Hugging Face or ModelScope repository with the
hub's own client into ``<revision>.partial``, checks every listed file's size and hash, promotes it
with one rename and then writes the readiness marker; `python -m prewarm wait` is the serving Pod's
init container, which lets the engine start only once that marker exists.
"""
