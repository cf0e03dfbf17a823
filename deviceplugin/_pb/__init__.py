"""Generated from protos/ by hack/gen-protos.sh; never edit by hand."""
