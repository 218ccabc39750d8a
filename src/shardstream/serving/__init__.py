"""Serving any engine that runs sequences, for `stream` and `pipeline` alike: the OpenAI-compatible API,
the continuous-batching engine and its memory admission, offline batches, stop strings, text in and out."""
