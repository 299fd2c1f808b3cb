"""Questions over the example database with their gold SQL (the reward compares result sets)."""

from __future__ import annotations

QUESTIONS: list[dict[str, str]] = [
    {"question": "How many employees are there?", "gold_sql": "SELECT COUNT(*) FROM employees"},
    {"question": "List the names of all departments located in Paris.",
     "gold_sql": "SELECT name FROM departments WHERE city = 'Paris'"},
    {"question": "What is the highest salary of any employee?", "gold_sql": "SELECT MAX(salary) FROM employees"},
    {"question": "Which employees were hired in 2022? Give their names.",
     "gold_sql": "SELECT name FROM employees WHERE hired_year = 2022"},
    {"question": "How many employees work in the Engineering department?",
     "gold_sql": "SELECT COUNT(*) FROM employees e JOIN departments d ON e.department_id = d.id "
                 "WHERE d.name = 'Engineering'"},
    {"question": "What is the average salary per department? Give the department name and the average.",
     "gold_sql": "SELECT d.name, AVG(e.salary) FROM employees e JOIN departments d ON e.department_id = d.id "
                 "GROUP BY d.name"},
    {"question": "Which projects have a budget above 250000?",
     "gold_sql": "SELECT name FROM projects WHERE budget > 250000"},
    {"question": "What is the total number of hours logged on the project Atlas?",
     "gold_sql": "SELECT SUM(a.hours) FROM assignments a JOIN projects p ON a.project_id = p.id "
                 "WHERE p.name = 'Atlas'"},
    {"question": "Which cities have more than one department?",
     "gold_sql": "SELECT city FROM departments GROUP BY city HAVING COUNT(*) > 1"},
    {"question": "Name the employees who work on no project.",
     "gold_sql": "SELECT name FROM employees WHERE id NOT IN (SELECT employee_id FROM assignments)"},
    {"question": "How many projects does each department run? Give the department name and the count.",
     "gold_sql": "SELECT d.name, COUNT(p.id) FROM departments d LEFT JOIN projects p ON p.department_id = d.id "
                 "GROUP BY d.name"},
    {"question": "Who is the most recently hired employee in Finance?",
     "gold_sql": "SELECT e.name FROM employees e JOIN departments d ON e.department_id = d.id "
                 "WHERE d.name = 'Finance' AND e.hired_year = (SELECT MAX(e2.hired_year) FROM employees e2 "
                 "JOIN departments d2 ON e2.department_id = d2.id WHERE d2.name = 'Finance')"},
]  # fmt: skip


def make_tasks(n: int) -> list[dict[str, str]]:
    """The first ``n`` questions, cycled when ``n`` is larger than the list."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    return [dict(QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
