"""stub"""
import streamlit as st


def render() -> None:
    st.header("sweeps")
