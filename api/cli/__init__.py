"""The `taper` command line (`cli`), the one-command demo (`demo`), the local API launcher it uses (`launcher`)
and the demo's report (`report`)."""
