"""`composer serve`: an HTTP jobs API (OpenAI-video-client shaped) over one loaded VideoGenerator.

    app.py       the FastAPI app: routes, error responses, /health, /metrics
    requests.py  a JSON body -> a checked SamplingParam (the checks generate_video makes, plus server limits)
    jobs.py      job records and their persistence in the output folder
    worker.py    the queue and the jobs running at once (tasks on the generator's request loop; progress, cancel,
                 timeout), streams included
    stream.py    WebSocket /v1/streams: live streams of causal models (JPEG frames per block, prompt switches)
    page.py      the web page at / (static/: plain HTML, CSS, JS) and GET /v1/model, which it reads
"""
