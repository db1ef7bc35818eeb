"""Stage 1, trace: the model's joint forward+backward ATen graph on fake tensors.

`joint.py` traces it; `fold.py` folds data-dependent reads of constants; `repeated_blocks.py`
traces one of the model's identical blocks and copies it for the others; `gc_pause.py` keeps
the collector off while planning builds its millions of objects.
"""
