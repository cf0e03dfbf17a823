"""The plugin's one typed config: what each key means, how it is checked, when it reloads.

`settings` holds the frozen dataclasses and `load`/`parse` (the sole reader of the config
file); `schema` lists every key once with its default, limits and choices; `checks` holds the
per-value checks and the problem list they fill; `watch` notices a changed file or ConfigMap
swap. Imports only `model`, `quantity` and `plumbing`: everything else reads config, config
reads nothing of theirs.
"""
