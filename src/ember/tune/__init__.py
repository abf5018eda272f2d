"""Tuning for the machine in front of the user (``ember tune``).

    device.py   the device fingerprint a result belongs to
    db.py       the SQLite tuning database (user's over a shared read-only one)
    space.py    candidate configurations of a generated kernel and the analytic model ranking them
    measure.py  running one kernel standalone: check against the default config, time
    kernels.py  tuning one generated kernel (resumable when the budget cuts it short)
    library.py  tuning one library choice: a convolution / linear layer's implementation
    apply.py    compile-time use: the tuned config of each kernel and the chosen implementation of
                each library call, when the database has one
    session.py  ``ember tune``: compile a model, collect its kernels and library sites, tune within
                a budget
"""
