"""The grader's parts (tutorials/grade.py is the command): the course's registry (course.py), the
student's process and the pipe to it (sandbox.py, child.py, wire.py), the instructor's flags
(scan.py), the drawn cases of the instructor's run (hidden.py, not in the student copy), and the
student and instructor copies of the course (copies.py)."""
