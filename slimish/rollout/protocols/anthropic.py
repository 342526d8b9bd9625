"""Placeholder: being written."""

from fastapi import APIRouter


def router(capture) -> APIRouter:
    return APIRouter()
