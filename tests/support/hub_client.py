"""A Hub client that records calls instead of making them, for the push tests (no network)."""

from __future__ import annotations

import importlib

from huggingface_hub import CommitInfo, Discussion
from huggingface_hub.errors import HfHubHTTPError

# huggingface_hub's HTTP client (httpx in 1.x, httpx2 in 2.x): its errors are what the Hub client raises.
HTTP = importlib.import_module(HfHubHTTPError.__mro__[1].__module__.split(".")[0])
TOKEN = "hf_test_token"


def http_error(status: int, reason: str) -> HfHubHTTPError:
    request = HTTP.Request("POST", "https://huggingface.co/api/repos/create")
    response = HTTP.Response(status, request=request, extensions={"reason_phrase": reason.encode()})
    return HfHubHTTPError(f"{status} Client Error: {reason}", response=response)


def pull_request(num: int, title: str, *, status: str = "open", author: str = "me") -> Discussion:
    return Discussion(
        title=title,
        status=status,
        num=num,
        repo_id="me/model",
        repo_type="model",
        author=author,
        is_pull_request=True,
        created_at=None,
        endpoint="https://huggingface.co",
    )


class FakeHub:
    """Stands in for `HfApi`: records `(method, args, kwargs)`; `fail[method]` makes that method raise."""

    def __init__(self, *, discussions: list[Discussion] | None = None, role: str = "write") -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail: dict[str, BaseException] = {}
        self.discussions = discussions or []
        self.role = role

    def _record(self, method: str, args: tuple, kwargs: dict) -> None:
        self.calls.append((method, args, kwargs))
        if method in self.fail:
            raise self.fail[method]

    def whoami(self, *args, **kwargs) -> dict:
        self._record("whoami", args, kwargs)
        return {"name": "me", "orgs": [{"name": "myorg"}], "auth": {"accessToken": {"role": self.role}}}

    def create_repo(self, *args, **kwargs) -> str:
        self._record("create_repo", args, kwargs)
        return f"https://huggingface.co/{args[0]}"

    def create_branch(self, *args, **kwargs) -> None:
        self._record("create_branch", args, kwargs)

    def get_repo_discussions(self, *args, **kwargs):
        self._record("get_repo_discussions", args, kwargs)
        return iter(self.discussions)

    def upload_folder(self, *args, **kwargs) -> CommitInfo:
        self._record("upload_folder", args, kwargs)
        pr_url = "https://huggingface.co/me/model/discussions/3" if kwargs.get("create_pr") else None
        return CommitInfo(
            commit_url="https://huggingface.co/me/model/commit/abc",
            commit_message=kwargs["commit_message"],
            commit_description="",
            oid="abc",
            pr_url=pr_url,
        )

    def method_names(self) -> list[str]:
        return [method for method, _, _ in self.calls]


class NoNetwork:
    """Any attribute access fails the test: proves a code path never talks to the Hub."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the Hub client was used ({name}) where no network is allowed")


def upload_call(hub: FakeHub) -> dict:
    uploads = [kwargs for method, _, kwargs in hub.calls if method == "upload_folder"]
    assert len(uploads) == 1
    return uploads[0]
