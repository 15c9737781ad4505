"""Circuit (being written)."""

import streamlit as st


def render() -> None:
    st.header("Circuit")
