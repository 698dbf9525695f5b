"""The engine and its loops: `Engine` (the step loop through a stepper), the sync and overlap
steppers, taking in a step's output, start-up, the in-thread and in-process clients, TP
workers."""
