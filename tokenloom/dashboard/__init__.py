"""The live dashboard: the seed's step picture while the server runs.

    engine thread                      event loop (only while a page is open)
    -------------                      --------------------------------------
    StepEvent -> StepBuffer  ------->  DashboardHub pump, every 0.25 s:
                 (bounded deque)         drain -> Aggregator -> one JSON update
                                         -> every open /dashboard/events stream

`recorder` is the only part that runs on the engine thread; `aggregate` is plain data
crunching with no engine, no asyncio and no HTTP; `hub` ties them to asyncio; the page
itself (HTML, CSS, JS, no external library) lies in `static/` and is served inlined by
`tokenloom.entrypoints.openai.dashboard_routes`.
"""
