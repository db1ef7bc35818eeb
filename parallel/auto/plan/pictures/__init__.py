"""The plan page's pictures: inline SVG drawn from a plan, its step simulation and its memory
estimate (no scripts, fonts or URLs, so the page opens anywhere, offline).

* svg.py        -- the few SVG elements every picture is made of
* timeline.py   -- the step as lanes: compute, and one per mesh axis for its collectives
* memory.py     -- the peak's parts as bars against the limit
* placements.py -- layers x parameters, coloured by what each mesh axis does
* scatter.py    -- predicted against measured step time, a point per plan, the y = x line
"""
