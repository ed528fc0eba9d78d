"""`composer serve`: one HTTP app over one loaded model (video or text): OpenAI-shaped video jobs, sessions and
live streams, or completions and chat.

    app.py       create_app: the video or text routes over server.py's one app
    server.py    ServeConfig, ServerState, build_app: auth, errors, /health, /ready, /metrics, /v1/models installed
                 once, then one router per route group
    responses.py error answers; problems.py: RequestProblem
    text.py      completions and chat routes; slots.py: their asyncio admission (priority, queue bound, timeout)
    sessions.py  /v1/sessions: causal sessions (extend, fork, snapshot, resume)
    requests.py  a JSON body -> a checked SamplingParam (the checks generate_video makes, plus server limits)
    jobs.py      job records and their persistence in the output folder
    worker.py    the queue and the jobs running at once (tasks on the generator's engine core; progress, cancel,
                 timeout), streams included
    stream.py    WebSocket /v1/streams: live streams of causal models (JPEG frames per block, prompt switches)
    page.py      the web page at / (static/: plain HTML, CSS, JS) and GET /v1/model, which it reads
"""
